// Refresh the dashboard body every few seconds without a full page reload.
(function () {
  "use strict";
  var body = document.getElementById("dashboard-body");
  var stamp = document.getElementById("dashboard-updated");
  if (!body) { return; }
  function refresh() {
    fetch(body.getAttribute("data-src"), { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.text(); })
      .then(function (html) {
        body.innerHTML = html;
        if (stamp) { stamp.textContent = "live · updated " + new Date().toLocaleTimeString(); }
      })
      .catch(function (e) { if (stamp) { stamp.textContent = "refresh failed (" + e.message + "), retrying"; } });
  }
  setInterval(refresh, 5000);
})();
