"""The ``shifu`` command line: dispatch to each command, the trainers' common flags, console hygiene (third-
party output kept quiet unless ``--verbose``). Nothing in shifu imports this wing.
"""
