"""Dashboard sign-in: a login link works once and briefly; a session cookie is not a login token."""
from billing_pipeline.dashboard import login
from billing_pipeline.dashboard.login import LOGIN, LOGIN_TTL_S, SESSION, LoginTokens

KEY = "admin-token-for-tests"
NOW = 1_900_000_000.0


def test_a_login_token_is_redeemed_once():
    tokens = LoginTokens(KEY)
    token = login.issue(KEY, LOGIN, LOGIN_TTL_S, now=NOW)
    assert tokens.redeem(token, now=NOW + 1)
    assert not tokens.redeem(token, now=NOW + 2)


def test_a_login_token_expires():
    token = login.issue(KEY, LOGIN, LOGIN_TTL_S, now=NOW)
    assert not LoginTokens(KEY).redeem(token, now=NOW + LOGIN_TTL_S + 1)


def test_a_token_signed_with_another_key_or_altered_is_refused():
    tokens = LoginTokens(KEY)
    assert not tokens.redeem(login.issue("another-installation", LOGIN, LOGIN_TTL_S, now=NOW), now=NOW)
    expires, nonce, signature = login.issue(KEY, LOGIN, LOGIN_TTL_S, now=NOW).split(".")
    later = f"{int(expires) + 3600}.{nonce}.{signature}"  # stretching the expiry breaks the signature
    assert not tokens.redeem(later, now=NOW)
    for garbage in (None, "", "a.b", "x.y.z", "1.2.3.4"):
        assert not tokens.redeem(garbage, now=NOW)


def test_purposes_do_not_mix():
    tokens = LoginTokens(KEY)
    session = tokens.new_session(now=NOW)
    assert tokens.session_valid(session, now=NOW + 60)
    assert not tokens.redeem(session, now=NOW)  # a stolen cookie cannot mint more sessions
    assert not tokens.session_valid(login.issue(KEY, LOGIN, LOGIN_TTL_S, now=NOW), now=NOW)
    assert not tokens.session_valid(session, now=NOW + login.SESSION_TTL_S + 1)
    assert not LoginTokens("rotated-admin-token").session_valid(session, now=NOW)


def test_used_nonces_are_forgotten_after_they_expire():
    tokens = LoginTokens(KEY)
    for i in range(50):
        assert tokens.redeem(login.issue(KEY, LOGIN, LOGIN_TTL_S, now=NOW + i), now=NOW + i)
    tokens.redeem(login.issue(KEY, LOGIN, LOGIN_TTL_S, now=NOW + 1000), now=NOW + 1000)
    assert len(tokens._used) == 1


def test_login_url_points_at_the_billing_service():
    url = login.login_url("http://127.0.0.1:8090/", KEY, now=NOW)
    assert url.startswith("http://127.0.0.1:8090/dashboard/login?token=")
    assert LoginTokens(KEY).redeem(url.split("token=", 1)[1], now=NOW)
    assert SESSION != LOGIN


def test_a_non_ascii_token_is_simply_refused():
    tokens = LoginTokens(KEY)
    assert not tokens.redeem("1999999999.a.\u00e9", now=NOW)
    assert not tokens.session_valid("1999999999.a.\u00e9", now=NOW)


def test_the_signing_key_is_derived_from_the_admin_token_not_the_token_itself():
    import base64
    import hashlib
    import hmac

    assert login.signing_key(KEY) != KEY.encode()
    assert login.signing_key(KEY) != login.signing_key("another-admin-token")
    payload = f"{int(NOW) + 60}.nonce"
    raw = hmac.new(KEY.encode(), f"{LOGIN}:{payload}".encode(), hashlib.sha256).digest()  # keyed by the token itself
    forged = f"{payload}.{base64.urlsafe_b64encode(raw).decode().rstrip('=')}"
    assert not LoginTokens(KEY).redeem(forged, now=NOW)
    assert LoginTokens(KEY).redeem(login.issue(KEY, LOGIN, LOGIN_TTL_S, now=NOW), now=NOW)
