"""The torch model side of a scheduler rank: Llama-family model, loader, sampler, runner."""
