"""Profiles: the INI parser, include resolution and validation (dsr1d.core.profiles).

Schemas come from the real tunables (``build_core`` on a fake root), never from stand-ins, so a
profile that loads here loads in the daemon.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dsr1d.core.context import build_core
from dsr1d.core.profiles import ProfileError, ProfileStore, UnknownProfile, builtin_dir, parse_ini
from fakeroot import intel_box

BUILTINS = ("balanced", "efficient", "latency", "powersave", "sustained", "throughput")


@pytest.fixture(scope="module")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The schemas of every section, as the daemon's own profile store holds them."""
    core = build_core(intel_box(tmp_path_factory.mktemp("root")).path)
    return core.store.schemas


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    path = tmp_path / "user"
    path.mkdir()
    return path


@pytest.fixture
def store(user_dir: Path, schemas: dict) -> ProfileStore:
    """User directory first, then the shipped profiles: the daemon's search order."""
    return ProfileStore([user_dir, builtin_dir()], schemas)


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.conf"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def error_of(store: ProfileStore, name: str) -> ProfileError:
    with pytest.raises(ProfileError) as info:
        store.load(name)
    return info.value


def assert_error(exc: ProfileError, path: Path, line: int, *fragments: str) -> None:
    """``file:line: reason`` with exactly this file and line, and a reason naming the cause."""
    assert (exc.file, exc.line) == (str(path), line), str(exc)
    assert str(exc) == f"{path}:{line}: {exc.reason}"
    for fragment in fragments:
        assert fragment in exc.reason, str(exc)


# -- the shipped profiles ----------------------------------------------------------------------


def test_builtin_names(store: ProfileStore) -> None:
    assert sorted(p.stem for p in builtin_dir().glob("*.conf")) == list(BUILTINS)
    assert store.names() == list(BUILTINS)


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_profile_loads_and_validates(store: ProfileStore, schemas: dict, name: str) -> None:
    profile = store.load(name)
    assert profile.name == name
    assert profile.path == builtin_dir() / f"{name}.conf"
    assert profile.summary
    assert "main" not in profile.sections
    for section, values in profile.sections.items():
        assert section in schemas
        assert set(values) <= set(schemas[section]), section


def test_builtin_sections_cover_every_tunable(store: ProfileStore) -> None:
    tunables = {"cstate", "epb", "prefetcher", "thp"}
    assert tunables <= set(store.load("throughput").sections)
    assert tunables <= set(store.load("sustained").sections)


def test_builtin_values_are_typed(store: ProfileStore) -> None:
    latency = store.load("latency").sections
    assert latency["cstate"] == {"max_latency_us": 0}
    assert latency["thp"]["khugepaged_defrag"] is True
    assert latency["prefetcher"] == dict.fromkeys(
        ("l2_streamer", "l2_adjacent", "dcu_streamer", "dcu_ip"), True)
    assert latency["engine"] == {"dtype": "auto", "threads": 0}
    assert store.load("powersave").sections["thp"]["khugepaged_defrag"] is False


def test_sustained_includes_throughput(store: ProfileStore) -> None:
    sustained = store.load("sustained").sections
    throughput = store.load("throughput").sections
    assert sustained["prefetcher"] == throughput["prefetcher"]
    assert sustained["thp"] == throughput["thp"]
    assert sustained["engine"] == throughput["engine"]
    assert sustained["epb"] == {"epb": "balance-performance", "epp": "balance_performance"}
    assert sustained["cstate"] == {"max_latency_us": 20, "disable_deeper_than_us": 20}
    assert sustained["mitigation"] == {"enabled": True, "delta_percent": 2.0, "limit_margin_c": 1.5}
    assert store.load("sustained").summary.startswith("sustained throughput")


# -- includes ----------------------------------------------------------------------------------


def test_child_overrides_parent_key_by_key(store: ProfileStore, user_dir: Path) -> None:
    write(user_dir, "child", """
        [main]
        include = throughput
        [thp]
        enabled = madvise
        """)
    child = store.load("child")
    assert child.sections["thp"] == {"enabled": "madvise", "defrag": "defer+madvise",
                                     "khugepaged_defrag": True}
    assert child.sections["epb"] == {"epb": "performance", "epp": "performance"}
    assert child.summary == store.load("throughput").summary


def test_multiple_includes_apply_in_order(store: ProfileStore, user_dir: Path) -> None:
    write(user_dir, "first", """
        [main]
        summary = first
        [thp]
        enabled = never
        defrag = never
        [epb]
        epb = 1
        """)
    write(user_dir, "second", """
        [main]
        summary = second
        [thp]
        enabled = always
        [engine]
        threads = 3
        """)
    write(user_dir, "both", """
        [main]
        include = first, second
        [epb]
        epb = 2
        """)
    write(user_dir, "reversed", """
        [main]
        include = second first
        """)
    both = store.load("both")
    assert both.summary == "second"
    assert both.sections["thp"] == {"enabled": "always", "defrag": "never"}
    assert both.sections["epb"] == {"epb": 2}
    assert both.sections["engine"] == {"threads": 3}
    flipped = store.load("reversed")
    assert flipped.summary == "first"
    assert flipped.sections["thp"] == {"enabled": "never", "defrag": "never"}


def test_user_profile_including_its_own_name_gets_the_builtin(store: ProfileStore,
                                                              user_dir: Path) -> None:
    path = write(user_dir, "throughput", """
        [main]
        summary = my throughput
        include = throughput
        [thp]
        enabled = madvise
        """)
    mine = store.load("throughput")
    assert mine.path == path
    assert mine.summary == "my throughput"
    assert mine.sections["thp"] == {"enabled": "madvise", "defrag": "defer+madvise",
                                    "khugepaged_defrag": True}
    assert mine.sections["cstate"] == {"max_latency_us": 2, "disable_deeper_than_us": 2}
    # A built-in that includes "throughput" now gets the user's one.
    assert store.load("sustained").sections["thp"]["enabled"] == "madvise"


def test_user_dir_overrides_builtin_and_adds_names(store: ProfileStore, user_dir: Path) -> None:
    write(user_dir, "latency", """
        [main]
        summary = replaced
        [thp]
        enabled = never
        """)
    write(user_dir, "extra", """
        [main]
        summary = new one
        """)
    assert store.names() == sorted((*BUILTINS, "extra"))
    latency = store.load("latency")
    assert latency.path == user_dir / "latency.conf"
    assert latency.summary == "replaced"
    assert latency.sections == {"thp": {"enabled": "never"}}
    assert store.load("extra").summary == "new one"


# -- syntax errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, line, fragments", [
    ("[main]\nsummary = x\n\n# comment\n[thp]\nenabled madvise\n", 6,
     ("expected 'key = value'",)),
    ("# a comment\n\nenabled = madvise\n[thp]\n", 3, ("before any [section]",)),
    ("[main]\nsummary = x\n[thp\nenabled = madvise\n", 3, ("malformed section header",)),
    ("[main]\n[]\n", 2, ("malformed section header",)),
    ("[thp]\nenabled = madvise\n; comment\n[epb]\nepb = 1\n[thp]\ndefrag = never\n", 6,
     ("section [thp] appears twice",)),
    ("[thp]\nenabled = madvise\n\n  enabled=never\n", 4, ("key 'enabled' appears twice",)),
    ("[thp]\n= madvise\n", 2, ("empty key",)),
], ids=["missing-equals", "key-before-section", "malformed-header", "empty-header",
        "duplicate-section", "duplicate-key", "empty-key"])
def test_syntax_errors(store: ProfileStore, user_dir: Path, text: str, line: int,
                       fragments: tuple[str, ...]) -> None:
    path = user_dir / "bad.conf"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        parse_ini(path)
    assert_error(info.value, path, line, *fragments)
    assert_error(error_of(store, "bad"), path, line, *fragments)


def test_parse_ini_keeps_file_and_line_of_every_value(user_dir: Path) -> None:
    path = write(user_dir, "ok", """
        # leading comment
        [main]
        summary = a = b

        [ thp ]
          enabled   =   madvise
        """)
    sections = parse_ini(path)
    assert sections["main"]["summary"].value == "a = b"
    entry = sections["thp"]["enabled"]
    assert (entry.value, entry.file, entry.line) == ("madvise", str(path), 6)


# -- schema errors -----------------------------------------------------------------------------


def test_unknown_section(store: ProfileStore, user_dir: Path) -> None:
    path = write(user_dir, "bad", """
        [main]
        summary = x

        [thp]
        enabled = madvise
        [hugepages]
        enabled = yes
        """)
    assert_error(error_of(store, "bad"), path, 6, "unknown section [hugepages]", "thp", "epb")


def test_unknown_section_with_spaced_header_has_its_line(store: ProfileStore,
                                                         user_dir: Path) -> None:
    path = write(user_dir, "bad", """
        [main]
        summary = x
        [ hugepages ]
        enabled = yes
        """)
    assert_error(error_of(store, "bad"), path, 3, "unknown section [hugepages]")


@pytest.mark.parametrize("section, key", [
    ("thp", "enable"), ("prefetcher", "l3_streamer"), ("engine", "thread"),
    ("mitigation", "enable"),
])
def test_unknown_key(store: ProfileStore, user_dir: Path, schemas: dict, section: str,
                     key: str) -> None:
    path = write(user_dir, "bad", f"""
        [main]
        summary = x
        [{section}]
        {key} = 1
        """)
    known = ", ".join(sorted(schemas[section]))
    assert_error(error_of(store, "bad"), path, 4,
                 f"[{section}] unknown key {key!r} (known: {known})")


def test_unknown_key_in_main(store: ProfileStore, user_dir: Path) -> None:
    path = write(user_dir, "bad", """
        [main]
        sumary = typo
        """)
    assert_error(error_of(store, "bad"), path, 2, "[main] unknown key 'sumary'")


@pytest.mark.parametrize("section, key, value, fragment", [
    ("epb", "epb", "16", "'16' is not 0..15"),
    ("thp", "enabled", "sometimes", "'sometimes' is not one of: always, madvise, never"),
    ("cstate", "max_latency_us", "-1", "-1 is outside 0.."),
    ("prefetcher", "l2_streamer", "maybe", "'maybe' is not a boolean"),
    ("cstate", "governor", "fast", "'fast' is not one of"),
    ("engine", "threads", "many", "'many' is not an integer"),
    ("mitigation", "limit_temp_c", "200", "200 is outside 0..125"),
    ("mitigation", "delta_percent", "nan", "nan is outside 0..50"),
    ("mitigation", "probe_bins", "2.5", "'2.5' is not an integer"),
])
def test_bad_values(store: ProfileStore, user_dir: Path, section: str, key: str, value: str,
                    fragment: str) -> None:
    path = write(user_dir, "bad", f"""
        [main]
        summary = x

        [{section}]
        # comment
        {key} = {value}
        """)
    assert_error(error_of(store, "bad"), path, 6, f"[{section}] {key}: ", fragment)


def test_bad_value_in_an_included_profile_points_at_that_file(store: ProfileStore,
                                                               user_dir: Path) -> None:
    parent = write(user_dir, "parent", """
        [thp]
        defrag = sometimes
        """)
    write(user_dir, "child", """
        [main]
        include = parent
        [thp]
        enabled = always
        """)
    assert_error(error_of(store, "child"), parent, 2, "[thp] defrag: ")


# -- include errors ----------------------------------------------------------------------------


def test_include_of_a_missing_profile(store: ProfileStore, user_dir: Path) -> None:
    path = write(user_dir, "bad", """
        [main]
        summary = x
        include = throughput, nosuch
        """)
    assert_error(error_of(store, "bad"), path, 3, "include: ", "unknown profile 'nosuch'",
                 "available: bad, balanced")


def test_include_cycle_of_two(store: ProfileStore, user_dir: Path) -> None:
    a = write(user_dir, "a", "[main]\nsummary = a\ninclude = b\n")
    b = write(user_dir, "b", "# b\n[main]\n\ninclude = a\n")
    assert_error(error_of(store, "a"), b, 4, "include cycle: a -> b -> a")
    assert_error(error_of(store, "b"), a, 3, "include cycle: b -> a -> b")


def test_include_cycle_of_three_through_builtin_override(store: ProfileStore,
                                                          user_dir: Path) -> None:
    # sustained (built-in) includes throughput, which is now the user's one.
    write(user_dir, "throughput", "[main]\ninclude = sustained\n")
    # The cycle closes at the built-in's include line.
    sustained = builtin_dir() / "sustained.conf"
    line = sustained.read_text().splitlines().index("include = throughput") + 1
    assert_error(error_of(store, "throughput"), sustained, line,
                 "include cycle: throughput -> sustained -> throughput")


def test_self_include_without_an_overridden_profile_is_an_error(store: ProfileStore,
                                                                 user_dir: Path) -> None:
    path = write(user_dir, "solo", "[main]\nsummary = alone\n\ninclude = solo\n")
    assert_error(error_of(store, "solo"), path, 4, "include")


def test_self_include_is_reported_as_a_cycle(store: ProfileStore, user_dir: Path) -> None:
    path = write(user_dir, "solo", "[main]\ninclude = solo\n")
    exc = error_of(store, "solo")
    assert_error(exc, path, 2)
    assert "unknown profile" not in exc.reason
    assert "cycle" in exc.reason or "itself" in exc.reason


def test_include_with_no_names(store: ProfileStore, user_dir: Path) -> None:
    path = write(user_dir, "bad", "[main]\ninclude = , ,\n")
    assert_error(error_of(store, "bad"), path, 2, "include: expected profile names")


# -- unknown names and load_all ----------------------------------------------------------------


def test_unknown_profile_lists_available_names(store: ProfileStore, user_dir: Path) -> None:
    write(user_dir, "mine", "[main]\nsummary = mine\n")
    with pytest.raises(UnknownProfile) as info:
        store.load("nosuch")
    expected = sorted((*BUILTINS, "mine"))
    assert info.value.name == "nosuch"
    assert info.value.available == expected
    assert str(info.value) == f"unknown profile 'nosuch'; available: {', '.join(expected)}"


@pytest.mark.parametrize("name", ["../throughput", "", ".hidden", "a/b"])
def test_names_that_are_not_profile_names_are_unknown(store: ProfileStore, name: str) -> None:
    with pytest.raises(UnknownProfile):
        store.load(name)


def test_load_all_loads_the_good_and_reports_the_broken(store: ProfileStore,
                                                        user_dir: Path) -> None:
    good = write(user_dir, "good", "[main]\nsummary = fine\ninclude = balanced\n")
    syntax = write(user_dir, "syntax", "[main]\nsummary\n")
    value = write(user_dir, "value", "[main]\n[thp]\nenabled = sometimes\n")
    write(user_dir, "cyc1", "[main]\ninclude = cyc2\n")
    cyc2 = write(user_dir, "cyc2", "[main]\ninclude = cyc1\n")
    profiles, errors = store.load_all()
    assert sorted(profiles) == sorted((*BUILTINS, "good"))
    assert profiles["good"].path == good
    assert profiles["good"].sections["thp"]["enabled"] == "madvise"
    assert sorted((e.file, e.line) for e in errors) == sorted([
        (str(cyc2), 2),          # cyc1 -> cyc2 -> cyc1, found in cyc2
        (str(user_dir / "cyc1.conf"), 2),   # cyc2 -> cyc1 -> cyc2, found in cyc1
        (str(syntax), 2),
        (str(value), 3),
    ])


def test_load_all_survives_a_dangling_symlink(store: ProfileStore, user_dir: Path) -> None:
    (user_dir / "gone.conf").symlink_to(user_dir / "deleted.conf")
    profiles, errors = store.load_all()
    assert sorted(profiles) == list(BUILTINS)
    assert len(errors) <= 1  # reported or skipped, either is fine
