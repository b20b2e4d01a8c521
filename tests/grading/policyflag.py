"""``--no-source-policy`` only while the grader still has a static source policy (issue 40 removed
it): the tests of the grader's other parts then run without it; now, the grader's default."""
import importlib.util

NO_POLICY = ["--no-source-policy"] if importlib.util.find_spec("labkit.grading.policy") else []
