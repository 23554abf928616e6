"""Code that runs inside every engine (one per rank). Never imports widget or server code."""
