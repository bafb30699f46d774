"""The one error class for "the user gave something wrong": a config value, a file, a folder, a
download that did not come. Every script catches it and prints one line (error: ...) with no
traceback. No torch here: fineweb.py stays light."""


class UserError(Exception):
    """Bad configuration, input or data: one line that names the key, file or value, what was
    expected and what to do."""
