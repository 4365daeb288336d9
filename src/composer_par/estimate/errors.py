"""The estimator's error: inputs that cannot give an estimate."""


class EstimateError(ValueError):
    """The inputs cannot give an estimate; the message says which and why."""
