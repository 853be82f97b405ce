"""Lightning integration: the strategies and the callbacks (imports pytorch_lightning)."""
