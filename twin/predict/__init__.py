"""Trainable output-length models (XGBoost on request features; a frozen text encoder with a small head).

`twin predictor train/eval` drive these; `twin.policy.predictors.ModelPredictor` serves a saved model.
Heavy imports (xgboost, torch, transformers) happen inside the functions that need them: install them with
`pip install torch==2.13.0 'llmtwin[predict]'`.
"""
