"""Generation: sampling, grammars, the decode loop, speculative decoding, embeddings, perplexity."""
