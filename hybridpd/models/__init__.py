"""The bundled models' training text and evaluation (not engine code):
``corpus`` (the text they are trained and evaluated on) and ``perplexity``
(held-out perplexity through the native engine's forward pass)."""
