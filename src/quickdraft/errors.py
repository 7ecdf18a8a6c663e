"""The one exception type users see for bad input.

Everything that is the caller's fault (mismatched vocabularies, an empty prompt, an out-of-range
threshold, NaN logits, a context overflow, a missing model) raises :class:`QuickdraftError` with a
message that names the problem. The CLI prints the message on one line and exits with code 2.
"""


class QuickdraftError(ValueError):
    """Bad input or an unusable model, with a message that says what is wrong."""
