"""README's Quick start, verbatim, in a brand-new project: the snippets are read from
README.md (so this fails when the README drifts), the app is installed with pip from this
checkout into a fresh virtualenv, and the project runs under daphne."""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest

from tests.support.servers import ROOT, free_port, wait_listening
from tests.support.wsclient import RPC

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

NOT_SOURCE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "staticfiles")
FENCE = re.compile(r"^( *)```(\w+)\n(.*?)^\1```", re.S | re.M)


def quick_start() -> list[tuple[str, str]]:
    """The fenced blocks of README's Quick start: (language, text without the indent)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for indent, lang, body in FENCE.findall(section):
        lines = [line[len(indent) :] if line.startswith(indent) else line for line in body.splitlines()]
        blocks.append((lang, "\n".join(lines) + "\n"))
    return blocks


def target(lang: str, text: str) -> tuple[str, bool]:
    """The file a snippet names on its first line, and whether it is appended."""
    first = text.splitlines()[0]
    match = re.fullmatch(r"# (\S+)( \(append\))?", first) if lang in ("python", "ini") else None
    match = match or re.fullmatch(r"<!-- (\S+) -->()", first)
    assert match, f"a {lang} snippet of the Quick start does not name its file: {first!r}"
    return match[1], bool(match[2])


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The Quick start's project, built from the README, running under daphne."""
    root = tmp_path_factory.mktemp("quickstart")
    blocks = quick_start()
    shells = [text for lang, text in blocks if lang == "sh"]
    assert len(shells) == 3, "the Quick start has a setup block, a test block and a run block"
    # pip builds in the source tree (setuptools writes build/): install from a copy
    checkout = tmp_path_factory.mktemp("checkout") / "realtime_app"
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    setup = shells[0].replace("/path/to/realtime_app", str(checkout))
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT)))
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run(["bash", "-ec", setup], cwd=root, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for lang, text in blocks:
        if lang in ("python", "html", "ini"):
            path, append = target(lang, text)
            file = root / path
            file.parent.mkdir(parents=True, exist_ok=True)
            if append:
                file.write_text(file.read_text() + "\n" + text)
            else:
                file.write_text(text)
    venv = root / ".venv" / "bin"
    env["PATH"] = f"{venv}{os.pathsep}{env['PATH']}"
    env["VIRTUAL_ENV"] = str(root / ".venv")

    def manage(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(venv / "python"), "manage.py", *args], cwd=root, env={**env, **extra}, capture_output=True, text=True
        )

    check = manage("check")
    assert check.returncode == 0 and "no issues" in check.stdout, check.stdout + check.stderr
    imported = manage("shell", "-c", "import realtime_app; print(realtime_app.__file__)")
    assert str(root / ".venv") in imported.stdout, imported.stdout + imported.stderr  # the installed copy
    assert manage("migrate", "--noinput").returncode == 0
    superuser = manage(
        "createsuperuser",
        "--noinput",
        DJANGO_SUPERUSER_USERNAME="admin",
        DJANGO_SUPERUSER_PASSWORD="admin",
        DJANGO_SUPERUSER_EMAIL="admin@example.com",
    )
    assert superuser.returncode == 0, superuser.stderr
    tested = subprocess.run(["bash", "-ec", shells[1]], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert tested.returncode == 0 and " 3 passed" in tested.stdout, tested.stdout[-3000:] + tested.stderr[-2000:]
    run = [line for line in shells[2].splitlines() if line.startswith("daphne ")]
    assert run == ["daphne mysite.asgi:application"], shells[2]
    port = free_port()
    log = root / "daphne.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(venv / "daphne"), "-b", "127.0.0.1", "-p", str(port), *run[0].split()[1:]],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_listening(port, server, 30, log.read_text)
        yield f"http://127.0.0.1:{port}", log
    finally:
        server.terminate()
        server.wait(10)


def admin_login(base: str) -> str:
    """Log in through the admin's login form; the Cookie header for handshakes."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    opener.open(f"{base}/admin/login/").read()
    csrf = next(c.value for c in jar if c.name == "csrftoken")
    form = {"username": "admin", "password": "admin", "csrfmiddlewaretoken": csrf, "next": "/admin/"}
    request = urllib.request.Request(
        f"{base}/admin/login/", data=urllib.parse.urlencode(form).encode(), headers={"Referer": f"{base}/admin/"}
    )
    opener.open(request).read()
    cookies = {c.name: c.value for c in jar}
    assert "sessionid" in cookies
    return "; ".join(f"{k}={v}" for k, v in cookies.items())


def get(url: str, cookie: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_the_module_the_page_imports_is_served(project):
    base, _ = project
    status, page = get(base + "/")
    assert status == 200 and "/static/realtime_app/realtime.js" in page
    status, js = get(base + "/static/realtime_app/realtime.js")
    assert status == 200 and "export class RealtimeClient" in js


async def test_a_python_client_gets_the_ticker_and_the_policy_holds(project):
    base, _ = project
    ws = base.replace("http", "ws") + "/realtime/"
    async with RPC(ws) as anonymous:
        error = (await anonymous.call("subscribe", {"channel": "atelier:load:2000"}))["error"]
        assert error["data"]["reason"] == "forbidden_channel"
    async with RPC(ws, cookie=admin_login(base)) as staff:
        assert (await staff.subscribe("atelier:load:2000"))["interval_ms"] == 2000
        frames = await staff.frames(2, timeout=15)
        assert all(0 <= f["data"]["load"] <= 1 for f in frames)


async def test_an_event_published_from_a_view_arrives(project):
    base, _ = project
    async with RPC(base.replace("http", "ws") + "/realtime/") as client:
        await client.subscribe("orders")
        status, body = get(base + "/orders/new/")
        assert status == 200
        frame = (await client.frames(1))[0]
        assert frame["data"] == {"id": 42} and frame["seq"] == json.loads(body)["seq"]


def test_health_is_served_to_staff_only(project):
    base, _ = project
    assert get(base + "/realtime/api/health")[0] == 401
    status, body = get(base + "/realtime/api/health", admin_login(base))
    assert status == 200 and json.loads(body)["instances"]


def test_the_page_in_chromium(project):
    from selenium.webdriver.common.by import By

    from tests.support.browser import chromium, wait

    base, log = project
    browser = chromium()
    try:
        browser.get(base + "/")  # logged out: the refusal reaches the page
        wait(browser).until(lambda b: b.find_element(By.ID, "load").text == "refused: forbidden_channel")
        browser.get(base + "/admin/login/?next=/")
        browser.find_element(By.NAME, "username").send_keys("admin")
        browser.find_element(By.NAME, "password").send_keys("admin")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        wait(browser).until(lambda b: b.get_cookie("sessionid") is not None and "/login/" not in b.current_url)
        browser.get(base + "/")
        wait(browser).until(lambda b: re.fullmatch(r"\d\.\d\d \(#\d+\)", b.find_element(By.ID, "load").text))
        first = browser.find_element(By.ID, "load").text
        wait(browser).until(lambda b: b.find_element(By.ID, "load").text != first)  # live
        assert get(base + "/orders/new/")[0] == 200
        wait(browser).until(lambda b: b.find_element(By.ID, "order").text == "#42")
    finally:
        browser.quit()
    assert "Traceback" not in log.read_text(), log.read_text()


def test_the_quick_start_snippets_are_what_this_test_runs():
    blocks = quick_start()
    files = [target(lang, text)[0] for lang, text in blocks if lang in ("python", "html", "ini")]
    assert files == [
        "mysite/settings.py",
        "mysite/asgi.py",
        "mysite/urls.py",
        "myapp/realtime_channels.py",
        "myapp/views.py",
        "myapp/templates/myapp/index.html",
        "pytest.ini",
        "myapp/test_realtime.py",
    ]
    assert sys.version_info >= (3, 11)


def test_docs_testing_shows_the_quick_starts_tests_verbatim():
    """docs/testing.md's worked example is the Quick start's, which the project runs green."""
    readme = [text for lang, text in quick_start() if lang in ("ini", "python") and "test" in text.splitlines()[0]]
    testing = (ROOT / "docs" / "testing.md").read_text()
    docs = [
        "\n".join(body.splitlines()) + "\n" for _, lang, body in FENCE.findall(testing) if lang in ("ini", "python")
    ]
    assert readme and all(block in docs for block in readme), "docs/testing.md lost the Quick start's tests"


def test_the_demo_scripts_help_is_printed_at_once_without_installing(tmp_path):
    """Found: ``scripts/demo --help`` ran the whole install (59 s on a fresh clone) before
    printing a usage that ended in a stray shell line."""
    import shutil
    import subprocess

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    for name in ("demo", "_env.sh"):
        shutil.copy2(ROOT / "scripts" / name, scripts / name)
    shutil.copy2(ROOT / "requirements.txt", tmp_path / "requirements.txt")
    result = subprocess.run(
        [str(scripts / "demo"), "--help"], capture_output=True, text=True, timeout=20, env={"PATH": "/usr/bin:/bin"}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: scripts/demo") and "source" not in result.stdout
    assert not (tmp_path / ".venv").exists()  # nothing installed to print it
