"""The configuration tree: one frozen dataclass per trainer with a docstring per field (schema), YAML and
``key.sub=value`` loading, validation with messages that say what to change, and the ``--help-config`` text.
"""
