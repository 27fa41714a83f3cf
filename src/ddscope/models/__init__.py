"""The models: the native target forward and its layers, any other causal LM through transformers, the DFlash drafter,
weights, and the paged KV cache they write."""
