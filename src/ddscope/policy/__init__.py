"""`--budget auto`: the verify cost (cost), what is learned online (learn), one request's tree size and when to draft
(auto), and a batch's shared rows (batch)."""
