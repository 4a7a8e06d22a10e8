"""What ``gpu_check.py`` (and ``gpu_steps.py``) run, by job: the model (``model``), the
contenders (``contenders``), step times (``timing``), bit-exactness (``exactness``), syncs
(``syncs``), the CUDA-sanitizer child (``sanitizer``) and the bars and table (``report``).

Importing the package imports the harness first: the checkout's ``vartrace`` is the one
these modules import.
"""

import _harness  # noqa: F401
