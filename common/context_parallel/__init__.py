"""Context parallelism: ring attention and Ulysses (lesson 19)."""
