//! The admin console in the browser: its pages, embedded in the binary and served at
//! `/admin/ui` with a strict Content-Security-Policy, and its sign-in. A token is exchanged
//! once (`POST /admin/session`) for a session cookie (`HttpOnly`, `SameSite=Strict`, `Secure`
//! under TLS) and a CSRF token that every write must echo in `X-CSRF-Token`; the token itself
//! never travels in a URL and is never stored by the page.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::audit::{by_token, same, Actor};
use super::error::ApiError;
use super::{json_response, AppState, Response};
use crate::config::AdminRole;

const COOKIE: &str = "gateway_admin";

/// No request from the page for this long ends a session.
const IDLE: Duration = Duration::from_secs(30 * 60);
/// However active, a session lasts at most this long.
const LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// Sessions held at once; a sign-in past it ends the one least recently used.
const MAX_SESSIONS: usize = 1024;

/// Only what the page cannot do without: its own scripts, styles and API; no inline code, no
/// frames, no other origin.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The console's files, each with its content type.
const ASSETS: &[(&str, &str, &[u8])] = &[
    (
        "",
        "text/html; charset=utf-8",
        include_bytes!("../../ui/index.html"),
    ),
    (
        "/app.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../ui/app.js"),
    ),
    (
        "/tenants.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../ui/tenants.js"),
    ),
    (
        "/views.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../ui/views.js"),
    ),
    (
        "/app.css",
        "text/css; charset=utf-8",
        include_bytes!("../../ui/app.css"),
    ),
    (
        "/vendor/uPlot.iife.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../ui/vendor/uPlot.iife.min.js"),
    ),
    (
        "/vendor/uPlot.min.css",
        "text/css; charset=utf-8",
        include_bytes!("../../ui/vendor/uPlot.min.css"),
    ),
];

struct Session {
    name: String,
    role: AdminRole,
    csrf: String,
    created: Instant,
    seen: Instant,
    expires_at: i64,
}

impl Session {
    fn live(&self, now: Instant) -> bool {
        now.duration_since(self.seen) < IDLE && now.duration_since(self.created) < LIFETIME
    }
}

/// The signed-in sessions of this replica, by the SHA-256 of their cookie (so a memory dump or
/// a timing of the map's lookup reveals no usable cookie).
#[derive(Default)]
pub struct Sessions(parking_lot::Mutex<HashMap<String, Session>>);

impl Sessions {
    fn open(&self, actor: &Actor) -> (String, Value) {
        let cookie = random_hex();
        let csrf = random_hex();
        let now = Instant::now();
        let expires_at = crate::tenancy::unix_now() + LIFETIME.as_secs() as i64;
        let mut map = self.0.lock();
        map.retain(|_, s| s.live(now));
        if map.len() >= MAX_SESSIONS {
            let oldest = map
                .iter()
                .min_by_key(|(_, s)| s.seen)
                .map(|(k, _)| k.clone());
            map.remove(&oldest.unwrap_or_default());
        }
        let session = Session {
            name: actor.name.clone(),
            role: actor.role,
            csrf,
            created: now,
            seen: now,
            expires_at,
        };
        let shown = describe(&session);
        map.insert(digest(&cookie), session);
        (cookie, shown)
    }

    /// The session of `cookie`, still live, marked as seen now.
    fn find<T>(&self, cookie: &str, f: impl FnOnce(&Session) -> T) -> Option<T> {
        let now = Instant::now();
        let mut map = self.0.lock();
        let key = digest(cookie);
        let s = map.get_mut(&key)?;
        if !s.live(now) {
            map.remove(&key);
            return None;
        }
        s.seen = now;
        Some(f(s))
    }

    fn close(&self, cookie: &str) {
        self.0.lock().remove(&digest(cookie));
    }
}

fn describe(s: &Session) -> Value {
    json!({"name": s.name, "role": s.role.as_str(), "csrf_token": s.csrf, "expires_at": s.expires_at})
}

fn random_hex() -> String {
    crate::plugins::hex(&rand::random::<[u8; 32]>())
}

fn digest(s: &str) -> String {
    crate::plugins::hex(&Sha256::digest(s.as_bytes()))
}

/// The admin behind the request's session cookie, if it carries one. Writes must echo the
/// session's CSRF token: a page of another site can make the browser send the cookie (were
/// `SameSite` ever lost on the way), never read the token.
pub fn session_actor(
    state: &AppState,
    headers: &http::HeaderMap,
    method: &http::Method,
) -> Option<Result<Actor, ApiError>> {
    let cookie = cookie(headers)?;
    let found = state
        .sessions
        .find(cookie, |s| (s.name.clone(), s.role, s.csrf.clone()));
    let Some((name, role, csrf)) = found else {
        return Some(Err(ApiError::unauthorized(
            "The console session has expired or was ended; sign in again.",
        )));
    };
    if !matches!(*method, http::Method::GET | http::Method::HEAD) {
        let sent = headers.get("x-csrf-token").map(|v| v.as_bytes());
        if !sent.is_some_and(|t| same(t, csrf.as_bytes())) {
            return Some(Err(ApiError {
                code: Some("csrf_failed"),
                ..ApiError::forbidden(
                    "x-csrf-token",
                    "A change made with a console session must send its `X-CSRF-Token`.".into(),
                )
            }));
        }
    }
    Some(Ok(Actor { name, role }))
}

/// The value of the session cookie, from any `Cookie` header.
fn cookie(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
        .filter(|v| !v.is_empty())
}

/// `/admin/ui[/<file>]` and `/admin/session`; `None` for every other admin path.
pub async fn serve(
    state: &AppState,
    secure: bool,
    req: &http::request::Parts,
    body: &mut Option<hyper::body::Incoming>,
) -> Option<Result<Response, ApiError>> {
    let path = req.uri.path();
    if let Some(file) = path.strip_prefix("/admin/ui") {
        return Some(asset(&req.method, &req.headers, file));
    }
    if path != "/admin/session" {
        return None;
    }
    Some(match req.method.as_str() {
        "POST" => sign_in(state, secure, &req.headers, body).await,
        "GET" => match cookie(&req.headers).and_then(|c| state.sessions.find(c, describe)) {
            Some(v) => Ok(json_response(StatusCode::OK, &v)),
            None => Err(ApiError::unauthorized("Not signed in.")),
        },
        "DELETE" => {
            if let Some(c) = cookie(&req.headers) {
                state.sessions.close(c);
            }
            let mut r = json_response(StatusCode::OK, &json!({"signed_out": true}));
            set_cookie(&mut r, "", 0, secure);
            Ok(r)
        }
        _ => Err(ApiError::method_not_allowed(&req.method, path)),
    })
}

/// `POST /admin/session` `{"token": "..."}`: the token's admin, a session cookie and the CSRF
/// token the page sends with every change.
async fn sign_in(
    state: &AppState,
    secure: bool,
    headers: &http::HeaderMap,
    body: &mut Option<hyper::body::Incoming>,
) -> Result<Response, ApiError> {
    let bytes = super::read_body(headers, body, 4096, &state.http).await?;
    let v: Value = serde_json::from_slice(&bytes)?;
    let token = v["token"]
        .as_str()
        .ok_or_else(|| ApiError::invalid("token", "`token` must be the admin token, a string."))?;
    let Some(actor) = by_token(state, token) else {
        // Slows a guesser down without holding anything but this request.
        tokio::time::sleep(Duration::from_millis(250)).await;
        return Err(ApiError::unauthorized("Wrong admin token."));
    };
    let (cookie, shown) = state.sessions.open(&actor);
    tracing::info!(admin = %actor.name, "console sign-in");
    let mut r = json_response(StatusCode::OK, &shown);
    set_cookie(&mut r, &cookie, LIFETIME.as_secs(), secure);
    Ok(r)
}

fn set_cookie(r: &mut Response, value: &str, max_age: u64, secure: bool) {
    let secure = if secure { "; Secure" } else { "" };
    let c = format!(
        "{COOKIE}={value}; Path=/admin; Max-Age={max_age}; HttpOnly; SameSite=Strict{secure}"
    );
    r.headers_mut()
        .insert(header::SET_COOKIE, HeaderValue::from_str(&c).expect("hex"));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

/// One of the console's files, revalidated by its ETag.
fn asset(
    method: &http::Method,
    headers: &http::HeaderMap,
    file: &str,
) -> Result<Response, ApiError> {
    let path = format!("/admin/ui{file}");
    let Some(at) = ASSETS.iter().position(|(f, ..)| *f == file) else {
        return Err(ApiError::not_found(&path));
    };
    if !matches!(*method, http::Method::GET | http::Method::HEAD) {
        return Err(ApiError::method_not_allowed(method, &path));
    }
    let (_, content_type, bytes) = ASSETS[at];
    let etag = &etags()[at];
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .is_some_and(|v| v.as_bytes() == etag.as_bytes());
    let (status, body) = match fresh {
        true => (StatusCode::NOT_MODIFIED, Bytes::new()),
        false => (StatusCode::OK, Bytes::from_static(bytes)),
    };
    Ok(http::Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::ETAG, etag.as_str())
        .header(header::CACHE_CONTROL, "no-cache")
        .header(header::CONTENT_SECURITY_POLICY, CSP)
        .header(header::X_CONTENT_TYPE_OPTIONS, "nosniff")
        .header(header::REFERRER_POLICY, "no-referrer")
        .header(header::X_FRAME_OPTIONS, "DENY")
        .body(http_body_util::Full::new(body).boxed_unsync())
        .expect("static headers are valid"))
}

fn etags() -> &'static [String] {
    static ETAGS: OnceLock<Vec<String>> = OnceLock::new();
    ETAGS.get_or_init(|| {
        ASSETS
            .iter()
            .map(|(_, _, b)| format!("\"{}\"", &crate::plugins::hex(&Sha256::digest(b))[..32]))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let mut h = http::HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; gateway_admin=abc; b=2"),
        );
        assert_eq!(cookie(&h), Some("abc"));
        let mut h = http::HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("gateway_admin_x=1; gateway_admin="),
        );
        assert_eq!(cookie(&h), None);
    }

    #[test]
    fn sessions_end_when_closed_and_are_bounded() {
        let s = Sessions::default();
        let actor = Actor {
            name: "a".into(),
            role: AdminRole::Viewer,
        };
        let (c, shown) = s.open(&actor);
        assert_eq!(shown["role"], "viewer");
        assert!(s.find(&c, |x| x.name.clone()).is_some());
        s.close(&c);
        assert!(s.find(&c, |_| ()).is_none());
        for _ in 0..MAX_SESSIONS + 5 {
            s.open(&actor);
        }
        assert_eq!(s.0.lock().len(), MAX_SESSIONS);
    }
}
