"""The step loop and the state it moves: requests, step plans, results."""
