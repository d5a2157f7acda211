//! Backend strings as torch writes them: `"gloo"`, `"nccl"`, `"cpu:gloo,cuda:nccl"`, and what
//! each buffer kind is served by.

use crate::{Error, Result};

/// Which backend serves one kind of buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Engine {
    /// dist-gloo (host buffers; device buffers only through host staging).
    Gloo,
    /// dist-nccl (device buffers).
    Nccl,
}

/// A parsed backend string: who serves host buffers and who serves device buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BackendSpec {
    /// Serves `BufRef::Host`/`BufMut::Host` (`cpu:`).
    pub(crate) host: Option<Engine>,
    /// Serves `BufRef::Device`/`BufMut::Device` (`cuda:`). `Gloo` here means host staging,
    /// which only an explicit `cuda:gloo` asks for.
    pub(crate) device: Option<Engine>,
}

fn engine(name: &str) -> Option<Engine> {
    match name {
        "gloo" => Some(Engine::Gloo),
        "nccl" => Some(Engine::Nccl),
        _ => None,
    }
}

impl BackendSpec {
    /// Parses `s` ([`Error::UnknownBackend`] for a name that is no backend, and
    /// [`Error::InvalidBackend`] for a malformed string): a bare name serves the buffers it is made for (`"gloo"`: host, `"nccl"`:
    /// device); `"dev:name"` entries, comma-separated, name one backend per device type
    /// (`cpu` or `cuda`), each at most once.
    pub(crate) fn parse(s: &str) -> Result<BackendSpec> {
        let unknown = |why: String| Error::InvalidBackend {
            spec: s.to_owned(),
            reason: why,
        };
        // Names are case-insensitive, as torch's `Backend` lowercases them ("NCCL",
        // "CPU:GLOO,CUDA:NCCL").
        let lowered = s.trim().to_ascii_lowercase();
        let s_trim = lowered.as_str();
        if !s_trim.contains(':') {
            return match engine(s_trim) {
                Some(Engine::Gloo) => Ok(BackendSpec {
                    host: Some(Engine::Gloo),
                    device: None,
                }),
                Some(Engine::Nccl) => Ok(BackendSpec {
                    host: None,
                    device: Some(Engine::Nccl),
                }),
                None => Err(Error::UnknownBackend {
                    name: s_trim.to_owned(),
                    available: crate::group::AVAILABLE_BACKENDS,
                }),
            };
        }
        let mut spec = BackendSpec {
            host: None,
            device: None,
        };
        for entry in s_trim.split(',') {
            let Some((dev, name)) = entry.trim().split_once(':') else {
                return Err(unknown(format!("entry {entry:?} is not device:backend")));
            };
            let (dev, name) = (dev.trim(), name.trim());
            let e = engine(name).ok_or_else(|| Error::UnknownBackend {
                name: name.to_owned(),
                available: crate::group::AVAILABLE_BACKENDS,
            })?;
            let slot = match dev {
                "cpu" => &mut spec.host,
                "cuda" => &mut spec.device,
                other => {
                    return Err(unknown(format!(
                        "unknown device type {other:?} (expected cpu or cuda)"
                    )));
                }
            };
            if slot.is_some() {
                return Err(unknown(format!("device type {dev:?} is named twice")));
            }
            if dev == "cpu" && e == Engine::Nccl {
                return Err(unknown("nccl cannot serve cpu buffers".into()));
            }
            *slot = Some(e);
        }
        Ok(spec)
    }

    /// The backend names this spec needs compiled in.
    pub(crate) fn needs(&self) -> impl Iterator<Item = &'static str> + '_ {
        let name = |e: &Engine| match e {
            Engine::Gloo => "gloo",
            Engine::Nccl => "nccl",
        };
        let staging = (self.device == Some(Engine::Gloo)).then_some("nccl");
        self.host
            .iter()
            .chain(self.device.iter())
            .map(name)
            // Host staging copies with the CUDA driver, which dist-nccl loads.
            .chain(staging)
    }

    /// Fails with [`Error::UnknownBackend`] naming what this build lacks.
    pub(crate) fn check_available(
        &self,
        spec: &str,
        available: &'static [&'static str],
    ) -> Result<()> {
        match self.needs().find(|n| !available.contains(n)) {
            Some(missing) => Err(Error::UnknownBackend {
                name: if missing == spec {
                    spec.to_owned()
                } else {
                    format!("{spec} (needs {missing})")
                },
                available,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> BackendSpec {
        BackendSpec::parse(s).unwrap()
    }

    #[test]
    fn torch_spellings_parse() {
        use Engine::*;
        assert_eq!(
            p("gloo"),
            BackendSpec {
                host: Some(Gloo),
                device: None
            }
        );
        assert_eq!(
            p("nccl"),
            BackendSpec {
                host: None,
                device: Some(Nccl)
            }
        );
        assert_eq!(
            p("cpu:gloo,cuda:nccl"),
            BackendSpec {
                host: Some(Gloo),
                device: Some(Nccl)
            }
        );
        assert_eq!(
            p(" cuda:nccl , cpu:gloo "),
            BackendSpec {
                host: Some(Gloo),
                device: Some(Nccl)
            }
        );
        assert_eq!(
            p("cpu:gloo"),
            BackendSpec {
                host: Some(Gloo),
                device: None
            }
        );
        assert_eq!(
            p("cpu:gloo,cuda:gloo"),
            BackendSpec {
                host: Some(Gloo),
                device: Some(Gloo)
            }
        );
        // Any case, as torch lowercases.
        assert_eq!(p("GLOO"), p("gloo"));
        assert_eq!(p("NCCL"), p("nccl"));
        assert_eq!(p("CPU:Gloo,CUDA:NCCL"), p("cpu:gloo,cuda:nccl"));
    }

    #[test]
    fn bad_strings_say_what_is_wrong() {
        for (s, what) in [
            ("cpu:gloo,cpu:gloo", "named twice"),
            ("tpu:nccl", "unknown device type \"tpu\""),
            ("cpu:nccl", "nccl cannot serve cpu"),
            ("cpu:gloo,cuda", "not device:backend"),
        ] {
            let e = BackendSpec::parse(s).unwrap_err().to_string();
            assert!(e.contains(what), "{s}: {e}");
            assert!(e.contains(s), "{s}: {e}");
        }
        for (s, name) in [("mpi", "mpi"), ("cuda:ucc", "ucc")] {
            let e = BackendSpec::parse(s).unwrap_err();
            assert!(
                matches!(&e, Error::UnknownBackend { name: n, .. } if n == name),
                "{s}: {e}"
            );
        }
    }

    #[test]
    fn availability_names_the_missing_backend() {
        let only_gloo: &'static [&'static str] = &["gloo"];
        p("gloo").check_available("gloo", only_gloo).unwrap();
        let e = p("nccl").check_available("nccl", only_gloo).unwrap_err();
        assert!(
            matches!(&e, Error::UnknownBackend { name, .. } if name == "nccl"),
            "{e}"
        );
        let e = p("cpu:gloo,cuda:nccl")
            .check_available("cpu:gloo,cuda:nccl", only_gloo)
            .unwrap_err();
        assert!(e.to_string().contains("needs nccl"), "{e}");
        // Staging Gloo onto device buffers needs the CUDA driver that dist-nccl loads.
        let e = p("cuda:gloo")
            .check_available("cuda:gloo", only_gloo)
            .unwrap_err();
        assert!(e.to_string().contains("needs nccl"), "{e}");
        p("cpu:gloo,cuda:gloo")
            .check_available("x", &["gloo", "nccl"])
            .unwrap();
    }
}
