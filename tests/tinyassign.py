"""Two tiny assignments (98_alpha: 98.1 and 98.2; 97_beta: 97.1) as an instructor's hidden-case file, and
a notebook builder, for the tests that grade whole submissions (batch grading, the Gradescope bundle)."""
import nbformat

CASES = '''
from labkit.grading.registry import exercise, expect_equal

ex = exercise("98.1", title="triple", notebook="98_alpha", points=2, hint="HINT-TRIPLE")
@ex.case("x=1", hidden=False)
def _(f): expect_equal(f(1), 3, "f(1)")
@ex.case("x=5")
def _(f): expect_equal(f(5), 15, "f(5)")

ex = exercise("98.2", title="negate", notebook="98_alpha", points=1)
@ex.case("x=1", hidden=False)
def _(f): expect_equal(f(1), -1, "f(1)")

ex = exercise("97.1", title="other", notebook="97_beta", points=5)
@ex.case("x=1", hidden=False)
def _(f): expect_equal(f(1), 1, "f(1)")
'''


def _nb(path, notebook, sources):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["labkit"] = {"notebook": notebook}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in ["from labkit.grading import check"] + sources]
    nbformat.write(nb, str(path))
    return path
