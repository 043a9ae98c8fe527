"""Model definitions (our own forward pass over the paged KV cache) and weight loading."""
