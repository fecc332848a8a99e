"""The one exception users of data_packing see: bad input, named in a one-line message."""


class DataError(ValueError):
    """Bad data, a missing file or an unknown name. The message is one line and names the culprit."""
