"""The KV cache: the batch's cache rows, the byte budget and the prefix cache."""
