"""The model and what feeds it: the GPT (`gpt`), its parameter names, the token data, the data
mixture bandit and the mesh shardings. Imports nothing of jaxckpt but `errors` and itself."""
