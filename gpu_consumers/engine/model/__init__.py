"""The Llama-family model as the engine runs it, and the model runner that feeds it a step."""
