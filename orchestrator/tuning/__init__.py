"""Hyperparameter search: a Tune study of training runs (`study.py`), its checks and trial configs
(`search.py`), its Tune callback (`trials.py`: MLflow child runs, the trial table) and what a
finished study reports (`results.py`)."""
