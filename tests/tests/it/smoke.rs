use dckpt_layout::{ModelSpec, OptimizerMode::*};
use dckpt_tests::{Setup, memory, reshard};

#[test]
fn same_layout_round_trip() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let s = Setup::new(4, 2, 1, 1, 2, 1, Distributed);
    let n = reshard(&memory(), &spec, s, s, 1);
    assert!(n > 0);
}

#[test]
fn tp_pp_ep_change() {
    let spec = ModelSpec::preset("tiny").unwrap();
    reshard(&memory(), &spec, Setup::new(8, 2, 2, 1, 2, 2, Layerwise), Setup::new(4, 1, 1, 1, 4, 1, Distributed), 2);
}

#[test]
fn checking_with_other_values_fails() {
    // The check is real: values of another seed are caught on the first element.
    let spec = ModelSpec::preset("tiny").unwrap();
    let s = Setup::new(2, 1, 1, 1, 1, 1, Adam);
    let store = memory();
    let m = s.model(&spec);
    assert!(dckpt_tests::save_model(&store, &m, 1).iter().all(|o| o.is_ok()));
    let results = dckpt_tests::load_and_check(&store, &m, 2);
    assert!(results.iter().all(|r| r.as_ref().is_err_and(|e| e.contains("element"))), "{results:?}");
}
