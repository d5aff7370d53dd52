"""The demo's channels per object in headless chromium against a real daphne: two lots and
two rooms in two tabs, each page on its own channel with its own state."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By

from tests.support.browser import chromium, log_in, wait
from tests.support.servers import Server

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


@pytest.fixture
def site(database):
    server = Server({**database, "REDIS_URL": ""}).start()
    yield server
    server.stop()


@pytest.fixture
def browser():
    b = chromium()
    yield b
    b.quit()


def text(browser, css):
    return browser.find_element(By.CSS_SELECTOR, css).text


def open_tab(browser, url):
    browser.switch_to.new_window("tab")
    browser.get(url)
    wait(browser, 15).until(lambda b: text(b, "#state") == "open")
    return browser.current_window_handle


def test_two_lots_in_two_tabs_each_follow_their_own_price(site, browser):
    log_in(browser, site.http, "demo", "demo")
    lot3 = open_tab(browser, site.http + "/demo/lot/3/")
    lot4 = open_tab(browser, site.http + "/demo/lot/4/")
    browser.switch_to.window(lot3)
    amount = browser.find_element(By.ID, "bid-amount")
    amount.clear()
    amount.send_keys("120")
    browser.find_element(By.CSS_SELECTOR, "#bid-form button").click()
    wait(browser, 10).until(lambda b: text(b, "#price") == "120" and text(b, "#bids") == "1")
    frames = browser.execute_script("return window.realtime.frames")
    assert all(f[1] == "demo:lot:3:250" for f in frames) and frames[-1][3] == {"lot": 3, "price": 120, "bids": 1}
    browser.switch_to.window(lot4)
    assert text(browser, "#price") == "0" and text(browser, "#bids") == "0"  # its own lot
    assert all(f[1].startswith("demo:lot:4:") for f in browser.execute_script("return window.realtime.frames"))
    browser.get(site.http + "/demo/lot/3/")  # a new page of lot 3 gets the price at once
    wait(browser, 10).until(lambda b: b.execute_script("return window.realtime.frames.length") >= 1)
    assert text(browser, "#price") == "120"
    browser.get(site.http + "/demo/lot/5000/")
    assert "Not Found" in browser.page_source or "no such lot" in browser.page_source


def test_two_rooms_in_two_tabs_never_see_each_others_messages(site, browser):
    log_in(browser, site.http, "demo", "demo")
    lobby = open_tab(browser, site.http + "/demo/room/lobby/")
    garden = open_tab(browser, site.http + "/demo/room/garden/")
    for handle, words in ((lobby, "hello lobby"), (garden, "hello garden")):
        browser.switch_to.window(handle)
        browser.find_element(By.ID, "post-text").send_keys(words)
        browser.find_element(By.CSS_SELECTOR, "#post-form button").click()
        wait(browser, 10).until(lambda b, words=words: words in text(b, "#messages"))
    browser.switch_to.window(lobby)
    seen = browser.execute_script("return window.realtime.seen")
    assert [data["text"] for _, data in seen] == ["hello lobby"]


def members_shown(browser):
    return {e.get_attribute("data-user"): e.text for e in browser.find_elements(By.CSS_SELECTOR, "#members .member")}


def test_a_room_page_lists_who_is_there_once_per_user_and_sees_them_leave(site, browser):
    log_in(browser, site.http, "demo", "demo")
    first = open_tab(browser, site.http + "/demo/room/meeting/")
    wait(browser, 10).until(lambda b: members_shown(b) == {"demo": "demo"})
    second = open_tab(browser, site.http + "/demo/room/meeting/")  # the same user, a second tab
    wait(browser, 10).until(lambda b: members_shown(b) == {"demo": "demo ×2"})
    browser.switch_to.window(first)
    wait(browser, 10).until(lambda b: members_shown(b) == {"demo": "demo ×2"})
    other = chromium()  # someone else, signed in elsewhere
    try:
        log_in(other, site.http, "admin", "admin")
        other.get(site.http + "/demo/room/meeting/")
        wait(browser, 10).until(lambda b: members_shown(b) == {"demo": "demo ×2", "admin": "admin"})
        assert text(browser, "#here-count").startswith("2 ")
    finally:
        other.quit()
    wait(browser, 15).until(lambda b: members_shown(b) == {"demo": "demo ×2"})  # admin left
    browser.switch_to.window(second)
    browser.close()
    browser.switch_to.window(first)
    wait(browser, 10).until(lambda b: members_shown(b) == {"demo": "demo"})
