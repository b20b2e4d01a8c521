"""``--no-source-policy`` while the grader still has the static source policy (issue 40 removes it):
the tests of the grader's other parts run without it; once it is gone, the grader's default."""
import inspect

from labkit.grading import grader

NO_POLICY = ["--no-source-policy"] if "no_source_policy" in inspect.getsource(grader.main) else []
