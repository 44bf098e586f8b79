"""The one marker class for mistakes a user can make (as opposed to bugs).

Every brf error that a wrong name, a bad file or a bad value can cause derives
from :class:`UserError`. The experiment mains (``brf.cli.run``) turn it into one
line on stderr and exit status 2; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A user's mistake: unknown name, bad file, bad value. Message names it."""
