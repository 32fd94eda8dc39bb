"""The data path: sources → cleaning → tokenizer → shards + manifest → loader."""
