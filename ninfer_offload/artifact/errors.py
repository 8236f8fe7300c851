"""The one exception every malformed or unreadable artifact raises."""

from ninfer_offload.errors import NinferError


class ArtifactError(NinferError, ValueError):
    """A `.ninfer` file (or a request against one) breaks a rule of the format.

    The message names the object or member at fault and the rule it breaks.
    """
