"""Headless Debian chromium driven by Selenium through Debian's chromedriver."""

from __future__ import annotations

import shutil
import tempfile

from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--window-size=1280,900",
]


def chromium() -> webdriver.Chrome:
    """A fresh headless browser with its own profile; fails (never skips) without chromium."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        raise RuntimeError("chromium and chromedriver are required (scripts/test installs Debian's packages)")
    options = Options()
    options.binary_location = binary
    for flag in FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    try:
        browser = webdriver.Chrome(service=Service(driver), options=options)
    except BaseException:
        shutil.rmtree(profile, ignore_errors=True)
        raise
    quit_browser = browser.quit

    def quit_and_remove_profile() -> None:
        """The browser's profile goes with it (a run left one directory per browser in /tmp)."""
        try:
            quit_browser()
        finally:
            shutil.rmtree(profile, ignore_errors=True)

    browser.quit = quit_and_remove_profile  # type: ignore[method-assign]
    return browser


def wait(browser: webdriver.Chrome, seconds: float = 20) -> WebDriverWait[webdriver.Chrome]:
    """An explicit wait: poll a condition until it holds, never a fixed sleep."""
    return WebDriverWait(
        browser,
        seconds,
        poll_frequency=0.1,
        ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
    )


def log_in(browser: webdriver.Chrome, base: str, username: str, password: str) -> None:
    """Log in through the form and return only once the session cookie is set.

    Clicking submit returns before the POST completes: a ``browser.get`` right after it
    races the login and may load the next page anonymously.
    """
    from selenium.webdriver.common.by import By

    browser.get(f"{base}/accounts/login/")
    wait(browser).until(lambda b: b.find_elements(By.NAME, "username"))
    browser.find_element(By.NAME, "username").send_keys(username)
    browser.find_element(By.NAME, "password").send_keys(password)
    browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    wait(browser).until(
        lambda b: b.get_cookie("sessionid") is not None and "/accounts/login/" not in b.current_url,
        f"login of {username} did not complete",
    )
    wait(browser).until(lambda b: b.execute_script("return document.readyState") == "complete")
