"""What a finished run shows a reader: the HTML report (``shifu report``), the comparison of runs (``shifu
report A B``) and model cards.
"""
