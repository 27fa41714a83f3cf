"""One sequence's speculative round, readable without the batching around it: sampling, the tree, prompt lookup, the
request's law, the proposers, the decoder's phases, completion rules and stats."""
