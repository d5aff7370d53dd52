import pytest

from realtime_app.declarations.registry import Registry
from realtime_app.exceptions import ConfigurationError, UnknownChannel


def factory(channel, publish):
    return None


@pytest.fixture
def reg():
    r = Registry()
    r.add_family("demo:clock", factory, default=1000, min=100, max=60000)
    r.add_channel("demo:events", "event")
    r.add_channel("demo:state", "state", factory)
    return r


def test_resolve_canonicalises_cadences(reg):
    assert reg.resolve("demo:clock").name == "demo:clock"
    assert reg.resolve("demo:clock:1000").name == "demo:clock"
    spec = reg.resolve("demo:clock:10")
    assert (spec.name, spec.interval_ms, spec.kind, spec.base) == ("demo:clock:100", 100, "state", "demo:clock")
    assert reg.resolve("demo:clock:0002000").name == "demo:clock:2000"
    assert str(spec) == "demo:clock:100"


def test_exact_and_event_channels(reg):
    assert reg.resolve("demo:events").kind == "event"
    assert not reg.resolve("demo:events").has_ticker
    assert reg.resolve("demo:state").has_ticker


@pytest.mark.parametrize(
    "name", ["demo:clock:abc", "demo:clock:-5", "demo:clock:1e3", "demo:clock:٣", "x" * 10_000, "demo", "demo:events:1"]
)
def test_unknown_and_garbage_names(reg, name):
    with pytest.raises(UnknownChannel) as info:
        reg.resolve(name)
    assert info.value.as_error()["data"]["reason"] == "unknown_channel"


def test_registration_errors(reg):
    with pytest.raises(ConfigurationError, match="already registered"):
        reg.add_family("demo:clock", factory, default=1000, min=100, max=60000)
    with pytest.raises(ConfigurationError, match="cadence of family"):
        reg.add_channel("demo:clock:2000", "state")
    with pytest.raises(ConfigurationError, match="min <= default <= max"):
        reg.add_family("bad", factory, default=10, min=100, max=60000)
    with pytest.raises(ConfigurationError, match="cannot have a factory"):
        reg.add_channel("ev", "event", factory)
    with pytest.raises(ConfigurationError):
        reg.add_channel(" spaced", "event")


def test_only_digit_suffixes_are_cadences_of_a_family():
    """Found in review: ``base:chat`` counted as a cadence of family ``base``, so the
    family's rules applied to an unrelated event channel."""
    from realtime_app.declarations.registry import registry

    assert registry.family_of("demo:clock:2000") is registry.families["demo:clock"]
    assert registry.family_of("demo:clock") is registry.families["demo:clock"]
    assert registry.family_of("demo:clock:chat") is None
    assert registry.family_of("demo:clock:-5") is None
