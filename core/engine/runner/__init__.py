"""The worker side of a step: flatten the batch, run the model, sample."""
