"""Expert parallelism: a mixture-of-experts layer over ranks and its model (lesson 20)."""
