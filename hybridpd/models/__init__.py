"""The bundled models (not engine code): ``bundled`` builds them from the
committed assets on first use, ``corpus`` is the text they are trained and
evaluated on, ``perplexity`` evaluates them through the native engine."""
