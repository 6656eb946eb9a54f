"""User-facing errors. Each message names the file / field / number at fault and what to do about it."""


class TamisError(Exception):
    """Base for errors caused by user input or state; the CLI prints these without a traceback."""


class ConfigError(TamisError):
    pass


class ArtifactError(TamisError):
    """An artifact is missing, or its content no longer matches the digest its manifest recorded."""


class DataError(TamisError):
    pass


class LabelImportError(TamisError):
    pass


class SelectionError(TamisError):
    pass


class ModelError(TamisError):
    pass


class ModelUnreachable(ModelError):
    """The model may well exist, but this machine cannot have it now (the hub is off or out of reach, and it is not
    in the HF cache): a property of the machine, not of the config that names it."""


class LockError(TamisError):
    pass
