//! The route table: every endpoint once, with its methods and metrics label. Dispatch, 404 vs
//! 405, the listener-role check and the `route` label of the HTTP metrics all read it.

use http::Method;

pub use crate::common::Endpoint;

#[derive(Clone, Copy)]
enum Path {
    Exact(&'static str),
    /// The path itself or anything below it (`<p>/...`).
    Tree(&'static str),
    /// Anything strictly below (`<p>...`, `p` ending in `/`).
    Under(&'static str),
}

impl Path {
    fn matches(self, path: &str) -> bool {
        match self {
            Path::Exact(p) => path == p,
            Path::Tree(p) => path
                .strip_prefix(p)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/')),
            Path::Under(p) => path.len() > p.len() && path.starts_with(p),
        }
    }
}

struct Route {
    path: Path,
    /// Empty: any method (the endpoint's own router answers 405).
    methods: &'static [Method],
    endpoint: Endpoint,
}

const POST: &[Method] = &[Method::POST];
const GET: &[Method] = &[Method::GET];

const ROUTES: &[Route] = &[
    Route {
        path: Path::Exact("/v1/chat/completions"),
        methods: POST,
        endpoint: Endpoint::Chat,
    },
    Route {
        path: Path::Exact("/v1/completions"),
        methods: POST,
        endpoint: Endpoint::Completions,
    },
    Route {
        path: Path::Exact("/v1/responses"),
        methods: POST,
        endpoint: Endpoint::Responses,
    },
    Route {
        path: Path::Under("/v1/responses/"),
        methods: &[Method::GET, Method::DELETE],
        endpoint: Endpoint::Response,
    },
    Route {
        path: Path::Exact("/v1/rerank"),
        methods: POST,
        endpoint: Endpoint::Rerank,
    },
    Route {
        path: Path::Exact("/v1/embeddings"),
        methods: POST,
        endpoint: Endpoint::Embeddings,
    },
    Route {
        path: Path::Exact("/v1/models"),
        methods: GET,
        endpoint: Endpoint::Models,
    },
    Route {
        path: Path::Under("/v1/models/"),
        methods: GET,
        endpoint: Endpoint::Model,
    },
    Route {
        path: Path::Tree("/v1/collections"),
        methods: &[],
        endpoint: Endpoint::Collections,
    },
    Route {
        path: Path::Exact("/health"),
        methods: GET,
        endpoint: Endpoint::Health,
    },
    Route {
        path: Path::Exact("/ready"),
        methods: GET,
        endpoint: Endpoint::Ready,
    },
    Route {
        path: Path::Exact("/metrics"),
        methods: GET,
        endpoint: Endpoint::Metrics,
    },
    Route {
        path: Path::Under("/admin/"),
        methods: &[],
        endpoint: Endpoint::Admin,
    },
];

/// How a request's method and path resolve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    Found(Endpoint),
    /// The path exists, not with this method (405).
    WrongMethod(Endpoint),
    /// No such path (404).
    Unknown,
}

pub fn resolve(method: &Method, path: &str) -> Resolved {
    let mut resolved = Resolved::Unknown;
    for r in ROUTES.iter().filter(|r| r.path.matches(path)) {
        if r.methods.is_empty() || r.methods.contains(method) {
            return Resolved::Found(r.endpoint);
        }
        resolved = Resolved::WrongMethod(r.endpoint);
    }
    resolved
}

/// The metrics label of `path`: its route's, or `other` for anything unknown, so a scanner
/// cannot blow up the label set.
pub fn label(path: &str) -> &'static str {
    ROUTES
        .iter()
        .find(|r| r.path.matches(path))
        .map_or("other", |r| r.endpoint.label())
}

impl Endpoint {
    /// Whether a listener in `role` serves this endpoint: the admin listener serves `/admin/*`
    /// and the probes and metrics; the API listener everything else.
    pub fn served_by(self, role: super::Role) -> bool {
        let probes = matches!(self, Endpoint::Health | Endpoint::Ready | Endpoint::Metrics);
        match role {
            super::Role::All => true,
            super::Role::Api => self != Endpoint::Admin,
            super::Role::Admin => self == Endpoint::Admin || probes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_methods_and_labels() {
        use Resolved::*;
        assert_eq!(
            resolve(&Method::POST, "/v1/chat/completions"),
            Found(Endpoint::Chat)
        );
        assert_eq!(
            resolve(&Method::GET, "/v1/chat/completions"),
            WrongMethod(Endpoint::Chat)
        );
        assert_eq!(
            resolve(&Method::GET, "/v1/models/x"),
            Found(Endpoint::Model)
        );
        assert_eq!(resolve(&Method::GET, "/v1/models/"), Unknown);
        assert_eq!(
            resolve(&Method::DELETE, "/v1/collections/kb"),
            Found(Endpoint::Collections)
        );
        assert_eq!(resolve(&Method::GET, "/v1/collectionsX"), Unknown);
        assert_eq!(
            resolve(&Method::PUT, "/admin/plugins/a/b"),
            Found(Endpoint::Admin)
        );
        assert_eq!(resolve(&Method::GET, "/admin"), Unknown);
        assert_eq!(resolve(&Method::GET, "/nope"), Unknown);
        assert_eq!(
            resolve(&Method::POST, "/v1/responses"),
            Found(Endpoint::Responses)
        );
        assert_eq!(
            resolve(&Method::DELETE, "/v1/responses/resp_1"),
            Found(Endpoint::Response)
        );
        assert_eq!(
            resolve(&Method::POST, "/v1/responses/resp_1"),
            WrongMethod(Endpoint::Response)
        );
        assert_eq!(label("/v1/collections/kb/search"), "collections");
        assert_eq!(label("/v1/models/m"), "models");
        assert_eq!(label("/wp-login.php"), "other");
    }
}
