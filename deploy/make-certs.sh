#!/usr/bin/env bash
# Make a private CA and every certificate and MQTT credential of one ddnn deployment.
#
#   deploy/make-certs.sh OUT_DIR --broker-host broker.lan [--broker-host 10.0.0.5] \
#       --devices cam0,cam1,cam2 [--edges edge0] [--operators operator] \
#       [--cloud-host cloud.lan] [--days 825] [--install-dir /etc/ddnn/tls]
#
# Writes into OUT_DIR:
#   ca.crt, ca.key            the deployment's CA (ca.key: keep it offline; only ca.crt travels)
#   broker.crt, broker.key    Mosquitto's server certificate, SAN = every --broker-host
#   cloud.crt, cloud.key      the cloud service's HTTPS certificate (with --cloud-host)
#   clients/ID.crt, ID.key    one client certificate per device, edge and operator (CN = ID;
#                             extendedKeyUsage clientAuth: also good for the cloud's mutual TLS,
#                             ddnn cloud --ssl-ca-certs ca.crt)
#   passwd                    Mosquitto password file (mosquitto_passwd), one user per ID
#   acl                       Mosquitto ACL: devices publish only under devices/ID/, edges own
#                             edges/ID/ and the results, operators announce bundles on
#                             ddnn/+/bundle (see mosquitto/acl.example)
#   env/ID.env                DDNN_DEVICE_* / DDNN_EDGE_* / DDNN_ANNOUNCE_* settings for that ID
#                             (CA, certificate, key, username, password) with paths under
#                             --install-dir
#
# Operators (--operators, default "operator") are the identities of the people or CI jobs that
# run `ddnn announce`: `set -a; . env/operator.env; ddnn announce --broker mqtts://... ...`.
#
# Running it again with more --devices adds the new ones and keeps the CA, the existing
# certificates and passwords. Keys are EC P-256 (fast on small boards). Host names that look
# like IPv4/IPv6 addresses become IP SANs. Needs openssl; mosquitto_passwd (from the mosquitto
# package) for the password file (without it, passwd is skipped with a warning).
#
# Install on each machine: ca.crt everywhere; broker.* and passwd/acl on the broker
# (deploy/mosquitto/secure.conf); clients/ID.* and env/ID.env on device or edge ID, mode 0600.
set -euo pipefail

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

out="" ; broker_hosts=() ; devices="" ; edges="edge0" ; operators="operator" ; cloud_host=""
days=825
install_dir="/etc/ddnn/tls" ; ca_days=3650
while [ $# -gt 0 ]; do
  case "$1" in
    --broker-host) broker_hosts+=("$2"); shift 2 ;;
    --devices) devices="$2"; shift 2 ;;
    --edges) edges="$2"; shift 2 ;;
    --operators) operators="$2"; shift 2 ;;
    --cloud-host) cloud_host="$2"; shift 2 ;;
    --days) days="$2"; shift 2 ;;
    --ca-days) ca_days="$2"; shift 2 ;;
    --install-dir) install_dir="$2"; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "make-certs: unknown option $1" >&2; usage ;;
    *) [ -z "$out" ] || usage; out="$1"; shift ;;
  esac
done
[ -n "$out" ] && [ ${#broker_hosts[@]} -gt 0 ] && [ -n "$devices" ] || usage

umask 077
mkdir -p "$out/clients" "$out/env"
cd "$out"

id_ok() { [[ "$1" =~ ^[a-z0-9][a-z0-9._-]{0,63}$ ]] || { echo "make-certs: invalid id '$1'" >&2; exit 2; }; }

san_for() {  # "DNS:a,IP:1.2.3.4" from host names
  local s="" h
  for h in "$@"; do
    if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then s+="${s:+,}IP:$h"; else s+="${s:+,}DNS:$h"; fi
  done
  echo "$s"
}

# 1. The CA (kept if it exists: re-running adds certificates under the same CA).
if [ ! -f ca.key ]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout ca.key -out ca.crt -days "$ca_days" -subj "/CN=ddnn deployment CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  echo "created CA: $out/ca.crt"
fi

# issue NAME CN EXTENSIONS: NAME.key + NAME.crt signed by the CA (kept if they exist).
issue() {
  local name="$1" cn="$2" ext="$3"
  [ -f "$name.crt" ] && return 0
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$name.key" -out "$name.csr" -subj "/CN=$cn" 2>/dev/null
  printf '%b' "$ext" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out "$name.crt" -days "$days" -sha256 -extfile "$name.ext" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
  echo "issued $name.crt (CN=$cn)"
}

server_ext() {
  echo "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=$(san_for "$@")\n"
}
client_ext="basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n"

# 2. Servers: the broker (and the cloud's HTTPS).
issue broker "${broker_hosts[0]}" "$(server_ext "${broker_hosts[@]}")"
[ -z "$cloud_host" ] || issue cloud "$cloud_host" "$(server_ext "$cloud_host")"

# 3. One client certificate, password and env file per device and edge.
have_passwd=1
command -v mosquitto_passwd >/dev/null || {
  have_passwd=0; echo "make-certs: mosquitto_passwd not found; skipping the password file" >&2; }
ids_of() { tr ',' '\n' <<<"$1" | sed '/^$/d'; }
add_client() {  # ID ROLE(DEVICE|EDGE|ANNOUNCE)
  local id="$1" role="$2" pw envf="env/$1.env"
  id_ok "$id"
  issue "clients/$id" "$id" "$client_ext"
  if [ -f "$envf" ]; then return 0; fi
  pw=$(openssl rand -base64 24 | tr -d '/+=\n')
  if [ "$have_passwd" = 1 ]; then
    if [ -f passwd ]; then mosquitto_passwd -b passwd "$id" "$pw"
    else mosquitto_passwd -c -b passwd "$id" "$pw"; fi
  fi
  cat > "$envf" <<EOF
DDNN_${role}_CA_FILE=$install_dir/ca.crt
DDNN_${role}_CERT_FILE=$install_dir/$id.crt
DDNN_${role}_KEY_FILE=$install_dir/$id.key
DDNN_${role}_USERNAME=$id
DDNN_${role}_PASSWORD=$pw
EOF
  if [ "$role" = EDGE ]; then  # the same certificate opens a mutual-TLS cloud
    cat >> "$envf" <<EOF
DDNN_EDGE_CLOUD_CA_FILE=$install_dir/ca.crt
DDNN_EDGE_CLOUD_CERT_FILE=$install_dir/$id.crt
DDNN_EDGE_CLOUD_KEY_FILE=$install_dir/$id.key
EOF
  fi
}
for id in $(ids_of "$devices"); do add_client "$id" DEVICE; done
for id in $(ids_of "$edges"); do add_client "$id" EDGE; done
for id in $(ids_of "$operators"); do add_client "$id" ANNOUNCE; done

# 4. The ACL: patterns for every device (%u = the username), one block per edge.
{
  echo "# Generated by deploy/make-certs.sh; see deploy/mosquitto/acl.example for the rules."
  echo "pattern write ddnn/+/devices/%u/#"
  echo "pattern write ddnn/+/gateways/%u/#"  # a gateway's username is its gateway id
  echo "pattern read ddnn/+/devices/+/status"
  echo "pattern read ddnn/+/edges/+/requests"
  echo "pattern read ddnn/+/edges/+/status"
  echo "pattern read ddnn/+/bundle"
  for id in $(ids_of "$edges"); do
    printf '\nuser %s\n' "$id"
    echo "topic read ddnn/+/devices/#"
    echo "topic read ddnn/+/gateways/#"
    echo "topic write ddnn/+/edges/$id/#"
    echo "topic write ddnn/+/results"
  done
  # Operators announce bundle versions (retained) and read them back; nothing else.
  for id in $(ids_of "$operators"); do
    printf '\nuser %s\n' "$id"
    echo "topic readwrite ddnn/+/bundle"
  done
} > acl
chmod 0644 ca.crt broker.crt acl; [ ! -f cloud.crt ] || chmod 0644 cloud.crt
echo "done: $out (ca.key is the deployment's root of trust: keep it off the network)"
