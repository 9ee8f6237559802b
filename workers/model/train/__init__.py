"""Training the demo model (`scripts/train_demo_model.py`): BPE tokenizer, batched differentiable forward,
standard-library corpus, rendered chat examples, evaluation. See run.py for the pipeline."""
