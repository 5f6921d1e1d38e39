"""The README's first two commands are the contract with a new user; CI must run the second."""
import re

from tests.conftest import REPO


def readme_commands() -> list[str]:
    text = open(f"{REPO}/README.md").read()
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)][:2]


def test_ci_runs_exactly_the_readme_test_command():
    main_job, tests = readme_commands()
    assert "pytest" in tests and "kvrt" in main_job
    ci = open(f"{REPO}/.ci/run").read().splitlines()
    assert tests in ci
