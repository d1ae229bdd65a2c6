//! The Helm chart holds the same content the Rust code renders: its CRDs are byte-for-byte
//! `wrk operator crds`, and its templates, with the values substituted the way Helm would, are the
//! objects of `wrk operator manifests` (less the Namespace, which `helm --create-namespace` makes).
//! There is no `helm` binary here, so the templates only use plain value substitutions.

use std::path::Path;

use wrk_operator::install::{self, InstallOptions};

fn chart() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/chart"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[test]
fn chart_crds_are_the_rendered_crds() {
    let expected = install::to_yaml(&install::crds()).unwrap();
    let actual = read(&chart().join("crds/crds.yaml"));
    assert!(
        actual == expected,
        "operator/chart/crds/crds.yaml is stale: regenerate it with \
         `cargo run -p wrk-cli -- operator crds > operator/chart/crds/crds.yaml`"
    );
}

#[test]
fn chart_templates_render_the_operator_manifests() {
    let options = InstallOptions {
        namespace: "wrk-system".to_string(),
        image: "registry.example/wrk:0.1.0".to_string(),
        pending_timeout_secs: 120,
    };
    let mut files: Vec<_> = std::fs::read_dir(chart().join("templates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let mut rendered = Vec::new();
    for file in files {
        let text = read(&file)
            .replace("{{ .Release.Namespace }}", &options.namespace)
            .replace("{{ .Values.image }}", &options.image)
            .replace(
                "{{ .Values.pendingTimeoutSecs }}",
                &options.pending_timeout_secs.to_string(),
            );
        assert!(
            !text.contains("{{"),
            "{}: template construct the test does not know",
            file.display()
        );
        for doc in text.split("\n---\n") {
            let value: serde_json::Value =
                serde_saphyr::from_str(doc).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            rendered.push(value);
        }
    }
    let key = |v: &serde_json::Value| format!("{}/{}", v["kind"], v["metadata"]["name"]);
    rendered.sort_by_key(key);
    let mut expected: Vec<serde_json::Value> = install::operator_manifests(&options)
        .unwrap()
        .into_iter()
        .filter(|o| o["kind"] != "Namespace")
        .collect();
    expected.sort_by_key(key);
    assert_eq!(rendered.len(), expected.len());
    for (r, e) in rendered.iter().zip(&expected) {
        assert_eq!(r, e, "chart template differs from the rendered {}", key(e));
    }
    // Helm's values file names the same defaults as the CLI.
    let values: serde_json::Value =
        serde_saphyr::from_str(&read(&chart().join("values.yaml"))).unwrap();
    assert_eq!(values["image"], concat!("wrk:", env!("CARGO_PKG_VERSION")));
    assert_eq!(values["pendingTimeoutSecs"], 120);
}
