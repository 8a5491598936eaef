"""The passes over the data: the ``DataLoop`` and the fit passes that run on it."""
