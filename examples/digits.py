"""The built-in digits job as a task file: scikit-learn's 8x8 digits (bundled, no download), the
built-in MLP (64 inputs, one hidden layer of 64, 10 classes), softmax cross-entropy.

    edgeps demo --task examples/digits.py

trains what plain ``edgeps demo`` trains, with the same figures; the report also gives macro-F1.
"""

from edgeps import ModelSpec, Task, load_digits

task = Task(
    name="digits",
    model=ModelSpec(hidden="64"),
    loss="cross_entropy",
    metrics=("accuracy", "macro_f1"),  # the first is the one reports and the frequency policy follow
    data=load_digits,  # the whole dataset: the demo and `edgeps data` hold out 20% and split the rest
)
