"""Training draft heads on the model's own answers: the data (`draft_data`) and the `train-draft` command
(`train_draft`). Imports the engine and `spec`; nothing else imports it."""
