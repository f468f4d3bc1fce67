"""The benchmark suite behind ``ddnn bench``: each benchmark runs its baseline in the same run."""
