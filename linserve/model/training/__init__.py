"""Training, data, evaluation and model cards: the offline side, never imported by inference."""
