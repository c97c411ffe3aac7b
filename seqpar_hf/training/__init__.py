"""The training side: Trainer integration, packing collators, TRL trainers."""
