"""The ledger store's URL as logged: no password."""

def test_the_clickhouse_password_never_reaches_the_log():
    from billing_pipeline.store import Store, redact_url

    assert redact_url("https://default:s3cr3t@ch.example:8443/db") == "https://default:***@ch.example:8443/db"
    assert redact_url("chdb:///var/lib/tokenmill") == "chdb:///var/lib/tokenmill"
    store = Store.__new__(Store)  # no server behind it: only the URL matters here
    store.url = "http://admin:s3cr3t@127.0.0.1:8123"
    assert "s3cr3t" not in store.display_url
