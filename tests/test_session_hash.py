"""The one Django private the endpoint uses (a user's session hash under a fallback
secret key), fenced behind its tested series with a public fallback that agrees with it."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from realtime_app.endpoint import sessions


@pytest.mark.django_db
def test_the_fallback_hash_is_djangos_own(monkeypatch):
    user = get_user_model().objects.create_user("hash-user", password="pw-1")
    private = user._get_session_auth_hash(secret="an old key")
    assert sessions.session_auth_hash(user, "an old key") == private
    monkeypatch.setattr(sessions, "TESTED_DJANGO", ())  # an untested series: the public rule
    assert sessions.session_auth_hash(user, "an old key") == private
    assert sessions.session_auth_hash(user, "another key") != private
