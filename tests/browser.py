"""A headless Chromium for the tests of kvmesh's web pages, driven through Selenium.

It runs Debian's chromium and chromedriver (apt packages `chromium` and
`chromium-driver`), named by path so that Selenium Manager never looks for (or downloads)
a browser of its own. The browser resolves no host name, so a page that reaches beyond
this machine fails its test rather than passing where there happens to be a network.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1400, 1000)
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"  # or $KVMESH_ARTIFACTS
QUIT_S = 5.0  # how long the browser's processes get to exit after quit()

OPTIONS = (
    "--headless=new",
    "--no-sandbox",  # the tests run as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-dev-shm-usage",  # a container's /dev/shm is often too small for it
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # loopback alone
)


@contextlib.contextmanager
def open_browser() -> Iterator:
    """A headless Chromium (a selenium WebDriver) at 1400x1000, quit on the way out with
    every process it started.

    Raises:
        RuntimeError: chromium or chromedriver is not installed (naming the packages).
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.is_file()]
    if missing:
        raise RuntimeError(
            f"the browser tests need {' and '.join(missing)}: "
            "apt-get install chromium chromium-driver"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for option in OPTIONS:
        options.add_argument(option)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=str(CHROMEDRIVER))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        started = _descendants(service.process.pid)
        driver.quit()
        _reap(started)


def wait_for_js(driver, expression: str, timeout_s: float = 10.0):
    """Poll the JavaScript `expression` until it is truthy; its value.

    Raises:
        AssertionError: it stayed falsy (or kept throwing) for `timeout_s`; the message
            holds the expression, its last value or error, and the browser's console.
    """
    from selenium.common.exceptions import JavascriptException

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = driver.execute_script(f"return ({expression});")
        except JavascriptException as error:
            value = f"it threw {error.msg}"
        else:
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"after {timeout_s} s, `{expression}` is still {value!r}; the browser's "
                f"console:\n{console_log(driver)}"
            )
        time.sleep(0.05)


def console_log(driver) -> str:
    """What the page wrote to the console since the last call, one entry a line."""
    entries = driver.get_log("browser")
    return "\n".join(f"{e['level']} {e['message']}" for e in entries) or "(empty)"


def save_screenshot(driver, name: str) -> Path:
    """Save what the browser shows as `name` (a .png) in the artifacts folder
    ($KVMESH_ARTIFACTS, else test-artifacts/ at the repository's root); its path."""
    folder = Path(os.environ.get("KVMESH_ARTIFACTS") or ARTIFACTS)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    assert driver.save_screenshot(str(path)), f"no screenshot saved at {path}"
    return path


def resource_urls(driver) -> list[str]:
    """Every URL the page loaded, itself included."""
    script = (
        "return [location.href].concat("
        "performance.getEntriesByType('resource').map((entry) => entry.name));"
    )
    return list(driver.execute_script(script))


# ---- the browser's processes ------------------------------------------------------------


def _descendants(pid: int) -> dict[int, str]:
    """The processes below `pid` (chromedriver's browser, its zygotes and renderers), each
    with its start time, so that a pid the system reuses later is told apart."""
    stats = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            stats[int(path.parent.name)] = _stat(path.read_text())
    children: dict[int, list[int]] = {}
    for child, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(child)
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = stats[child][19]
                todo.append(child)
    return found


def _stat(text: str) -> list[str]:
    # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"; the
    # fields from the state on, so [0] is the state, [1] the ppid, [19] the start time
    return text.rpartition(")")[2].split()


def _running(pid: int, started: str) -> bool:
    try:
        fields = _stat(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return False
    # a zombie has exited (only its parent's wait is missing); another start time is
    # another process
    return fields[0] != "Z" and fields[19] == started


def _reap(processes: dict[int, str]) -> None:
    """Wait for `processes` to exit, then kill the ones that did not."""
    deadline = time.monotonic() + QUIT_S
    while True:
        left = [pid for pid, started in processes.items() if _running(pid, started)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
